"""The environment library: a SQLite file of environment sources and task configs (`store`), what
an import reads (`published`, `rows`) and writes into it (`importing`, `writes`), and the plain
records everything else reads (`records`)."""
