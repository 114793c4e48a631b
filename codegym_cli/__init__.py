"""The `codegym` operator command line: servers, pipeline, export, evaluation (needs `codegym[server]`)."""
