"""What a client takes when it is not told: the runtime's address, and the environment variables
it reads its access from. Apart from `channels` (which loads gRPC), so that a command line can show
them in its `--help` without loading it."""

# Where `codegym up` and `codegym serve runtime` listen unless told otherwise.
DEFAULT_TARGET = "127.0.0.1:50051"
# The access token a process sends (`authorization: Bearer ...`), and the CA it checks the servers'
# certificates against (a CA turns TLS on).
TOKEN_ENV = "CODEGYM_TOKEN"
TLS_CA_ENV = "CODEGYM_TLS_CA"
