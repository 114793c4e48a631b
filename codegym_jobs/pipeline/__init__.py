"""The pipeline: problems in, verified environments and task configs in the library out."""
