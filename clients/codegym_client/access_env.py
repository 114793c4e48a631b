"""The environment variables a client reads its access from, apart from `channels` (which loads
gRPC) so that a command line can name them in its `--help` without loading it."""

# The access token a process sends (`authorization: Bearer ...`), and the CA it checks the servers'
# certificates against (a CA turns TLS on).
TOKEN_ENV = "CODEGYM_TOKEN"
TLS_CA_ENV = "CODEGYM_TLS_CA"
