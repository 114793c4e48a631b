"""What an operator runs against the services, apart from the command line that starts it: the
synthesis pipeline, evaluation, export of training instances, replay of published trajectories and
oracle recordings. Above the services and the sandbox worker, below `codegym_cli`."""
