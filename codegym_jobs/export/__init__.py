"""Training instances in CodeGym's published format, built from the environment library (`instances`)
and written to JSON lines or Parquet (`writers`)."""
