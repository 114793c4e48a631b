"""The runtime API as the client speaks it: messages and stubs of `codegym.common.v1` and
`codegym.runtime.v1`, generated from `protos/` by `make proto` (never edit them by hand).

They are the servers' generated modules (`codegym/common/v1`, `codegym/runtime/v1`) with their
imports pointed here, so the client ships no server package. The descriptors are the same bytes:
a process that loads both copies registers each proto file once and gets the same message classes.

    from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
"""
