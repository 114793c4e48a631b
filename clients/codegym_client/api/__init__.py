"""The runtime API: messages and stubs of `codegym.common.v1` and `codegym.runtime.v1`, generated
from `protos/codegym_client/api/` by `make proto` (never edit them by hand).

This is the one copy: the servers import it from here too (they depend on this distribution), and
the server-only APIs (`codegym/{sandbox,synthesis,verification}/v1`) import `common_pb2` from here.

    from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
"""
