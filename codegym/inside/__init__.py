"""Everything that runs inside a jail: the zygote and what it forks.

This package is bind-mounted read-only into every jail (at `/sandbox/inside`, see
`sandbox_worker/limits.py`) and is the only project code there. It lives in the core, beside the
contract, not in the worker: the contract reads configs and answers with its `values`, and the
core never imports the worker. It imports the standard library
only (a test fails the build otherwise): no project package, no third-party one. Environments'
own imports (gymnasium, numpy) are preloaded by name, never imported here. The trusted side
imports only its leaves (`frames`, `messages`, `values`, `settings`), which is how both sides speak
one protocol and read configs and answers by one rule.

- `frames`: the wire between worker, zygote and children: a JSON head, then raw binary parts.
- `messages`: what those frames hold: every key of a request and a result, declared once.
- `settings`: what a jail is told once, at start (resident ceiling, idle times, cache sizes).
- `values`: task configs and answers as JSON values (shared with `codegym.contract`).
- `operations`: what a forked child does with one request (untrusted code runs only there).
- `hygiene`: what keeps requests apart (an id per process, leftovers killed, /tmp wiped).
- `watchdog`: waiting for a child's result within its limits, and saying why there is none.
- `residents`: a session kept alive in its own process between steps.
- `codecache`: the sources a jail has compiled, kept by bytes and mirrored by the worker.
- `immortal`: the preloads made immortal, so a fork's children and the zygote copy fewer pages.
- `zygote`: the jail's long-lived process, serving one request at a time.
"""
