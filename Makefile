# One entry point for every routine task. `make install` is safe to re-run.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PY312 := $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
PROTOS := $(shell find protos -name '*.proto' | sort)
DEB_PACKAGES := libnl-route-3-200 libnl-3-200 redis-server chromium chromium-driver
LINT_PATHS := codegym codegym_jobs codegym_cli sandbox_worker services clients codegym_testkit tests bench


.PHONY: install deb-packages venv jail-paths proto check-proto buf-lint lint test test-fast test-trainers bench up demo clean k8s-validate docker-lint console-shots

# npm is not needed here: buf (protobuf lint) is installed by `make lint` the first time it runs.
install: deb-packages venv jail-paths

deb-packages:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; fi; \
	else echo "not root: make sure these Debian packages are installed: $(DEB_PACKAGES)"; fi

# Jails run as unprivileged uids, and nsjail mounts the interpreter as such a uid: every directory
# above the interpreter and the venv must be traversable (o+x; listing stays forbidden).
jail-paths: venv
	@for p in $$($(PY) -c 'import sys; print(sys.base_prefix, sys.prefix)'); do \
	  d=$$(readlink -f $$p); while [ "$$d" != "/" ]; do \
	    case "$$(stat -c %A $$d | cut -c10)" in x|t) ;; *) chmod o+x "$$d" && echo "o+x $$d (jails must reach the interpreter)";; esac; \
	    d=$$(dirname $$d); done; done

venv:
	@test -n "$(PY312)" || { echo "Python 3.12 not found: pyenv install 3.12 && pyenv local 3.12 (Debian 12 ships 3.11; README, Prerequisites)"; exit 1; }
	@test -x $(PY) || { echo "creating $(VENV) with $(PY312)"; $(PY312) -m venv $(VENV); }
	@echo "installing the client, the servers and the dev tools into $(VENV) (pip; about 30 s the first time)"
	@log=$$(mktemp); { $(PY) -m pip install -q --upgrade pip \
	  && $(PY) -m pip install -q -e './clients[gym]' -e '.[server,dev]'; } >$$log 2>&1 \
	  || { cat $$log; rm -f $$log; exit 1; }; rm -f $$log

# Only `make lint` needs buf, so only it needs npm (`make install` does not).
node_modules/.bin/buf: package.json
	@command -v npm >/dev/null || { echo "make lint needs npm to install buf (protobuf lint): apt-get install npm"; exit 1; }
	@echo "installing buf (protobuf lint) with npm"
	@npm install --silent --no-audit --no-fund
	@touch $@

# The runtime API (common, runtime) is generated once, into the client distribution that ships it:
# its protos live at protos/codegym_client/api/<svc>/v1/, so protoc names the modules
# codegym_client.api.<svc>.v1.* (written under clients/) and the server-only protos (sandbox,
# synthesis, verification: generated under codegym/) import them from there; the servers import
# the runtime API from codegym_client.api too. No rewriting: the import paths are the package paths.
CLIENT_API := clients/codegym_client/api
CLIENT_PROTOS := $(filter protos/codegym_client/%,$(PROTOS))
SERVER_PROTOS := $(filter-out protos/codegym_client/%,$(PROTOS))
PROTOC := PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -Iprotos

proto:
	rm -f $(CLIENT_API)/*/v1/*_pb2* codegym/*/v1/*_pb2*
	$(PROTOC) --python_out=clients --grpc_python_out=clients --mypy_out=clients --mypy_grpc_out=clients \
	  $(CLIENT_PROTOS)
	$(PROTOC) --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(SERVER_PROTOS)
	@! grep -nE '^(from|import) codegym\.' $(CLIENT_API)/*/v1/*_pb2* \
	  || { echo "the client's API imports a server package: move that proto under protos/codegym_client/"; exit 1; }

check-proto: proto
	@git diff --exit-code -- 'codegym/*/v1/*' $(CLIENT_API) \
	  || { echo "generated protobuf code is stale: run 'make proto' and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- 'codegym/*/v1/*' $(CLIENT_API))" || { \
	  git status --porcelain -- 'codegym/*/v1/*' $(CLIENT_API); \
	  echo "untracked generated files: run 'make proto' and commit"; exit 1; }

buf-lint: node_modules/.bin/buf
	cd protos && ../node_modules/.bin/buf lint

lint: buf-lint
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy codegym codegym_jobs codegym_cli sandbox_worker services codegym_testkit bench
	$(VENV)/bin/mypy --python-version 3.10 clients

test:
	$(VENV)/bin/pytest -q

# The part of the suite that starts no sandbox worker (no root, no nsjail) and builds nothing:
# about a minute on 2 cores (markers in pyproject.toml; README, Set up and run).
test-fast:
	$(VENV)/bin/pytest -q -m "not jail and not slow"

# The trainer adapters inside the trainers themselves (tests/test_verl_real.py, tests/test_trl_real.py)
# and the OpenEnv gateway with TRL's OpenEnv release (tests/test_openenv_core.py): verl and TRL need
# torch, so they get a venv of their own beside the client (`make test` skips those files). The runtime they play against runs from the project's venv (tests/helpers/with_runtime.py).
# Defaults fit this machine, where pip finds a CPU build of torch 2.13.0 on disk (Python 3.11 only);
# from PyPI alone `torch==2.13.0` is the CUDA build (several GB more), so elsewhere say e.g.
# TRAINERS_PYTHON=python3.12 TRAINERS_TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
# verl 0.9.1 imports cachetools, fastapi and uvicorn without requiring them; TRL on transformers
# < 5.13 parses tool calls with jmespath. Needs the project's venv (`make install`) for the servers.
TRAINERS_VENV ?= .venv-trainers
TRAINERS_PYTHON ?= $(shell pyenv prefix 3.11 2>/dev/null || echo /usr)/bin/python3
TRAINERS_TORCH ?= torch==2.13.0
TRAINERS ?= verl==0.9.1 trl==1.16.0 openenv-core==0.3.0
test-trainers:
	@test -x $(PY) || { echo "make test-trainers runs the servers from $(VENV): run 'make install' first"; exit 1; }
	test -x $(TRAINERS_VENV)/bin/python || $(TRAINERS_PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/python -m pip install -q $(TRAINERS_TORCH)
	$(TRAINERS_VENV)/bin/python -m pip install -q $(TRAINERS) cachetools fastapi uvicorn jmespath \
	  pytest pytest-asyncio pytest-timeout -e ./clients
	$(PY) -m tests.helpers.with_runtime --openenv -- env CODEGYM_TESTS_REQUIRE_TRAINERS=1 \
	  $(TRAINERS_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider \
	  tests/test_verl_real.py tests/test_trl_real.py tests/test_openenv_core.py

bench:
	$(PY) bench/sandbox_bench.py
	$(PY) bench/runtime_bench.py
	$(PY) bench/verification_bench.py
	$(PY) bench/eval_bench.py
	$(PY) bench/scale_bench.py

# Rollouts shaped as a trainer drives them (think time between steps, thousands of episodes in
# flight), a base commit beside the working tree: e.g. `make bench-rollouts ROLLOUT_ARGS=--quick`
# (a smoke test of a few minutes); every option in `$(PY) bench/rollout_bench.py --help`.
.PHONY: bench-rollouts
bench-rollouts:
	$(PY) bench/rollout_bench.py $(ROLLOUT_ARGS)

# Where a step's CPU goes: py-spy on every process of a loaded stack, by stage (a run of its own:
# the profiler perturbs the machine); e.g. `make bench-profile PROFILE_ARGS="--point 4096:16"`.
.PHONY: bench-profile
bench-profile:
	$(PY) bench/profile_bench.py $(PROFILE_ARGS)

# CodeGym at its published size: a 13,200-env library in the Hugging Face dataset's Parquet layout,
# generated from the samples, imported (time, peak RSS), served by a base commit and the working
# tree (start, PSS, steady rollouts and a GRPO burst across the whole library, targets PASS/FAIL):
# e.g. `make bench-library LIBRARY_ARGS=--quick`; every option in `$(PY) bench/library_scale.py --help`.
.PHONY: bench-library
bench-library:
	$(PY) bench/library_scale.py $(LIBRARY_ARGS)

# A simulated GRPO learner (groups of 8) on a few hundred generated envs, its tasks drawn uniformly
# or by SampleTasks from the served record: zero-variance groups, useful episodes, pass rate; then
# the steady rollout shape with recording on and off, alternating (targets PASS/FAIL): e.g.
# `make bench-curriculum CURRICULUM_ARGS=--quick`; every option in `$(PY) bench/curriculum_bench.py --help`.
.PHONY: bench-curriculum
bench-curriculum:
	$(PY) bench/curriculum_bench.py $(CURRICULUM_ARGS)

# Access tokens and TLS under the steady rollout shape (off / --auth / TLS, alternating, repeated),
# then two tenants, one flooding ten times its quota (targets PASS/FAIL): e.g.
# `make bench-access ACCESS_ARGS=--quick`; every option in `$(PY) bench/access_bench.py --help`.
.PHONY: bench-access
bench-access:
	$(PY) bench/access_bench.py $(ACCESS_ARGS)

# Forks, checkpoints and restores (docs/fork.md): 20/s each beside the 1,024-rollout shape against
# the same load without them (alternating), forks/s against creates/s with their CPU, an idle
# fork's and a suspended episode's memory, a tree of 1,024 leaves beside 1,024 straight episodes
# (targets PASS/FAIL): e.g. `make bench-fork FORK_ARGS=--quick`; every option in
# `$(PY) bench/fork_bench.py --help`.
.PHONY: bench-fork
bench-fork:
	$(PY) bench/fork_bench.py $(FORK_ARGS)

# Episodes through the trainer paths while runtimes, workers, the gateway and Redis fail on a
# schedule (20 minutes by default; `SOAK_ARGS="--minutes 3"` for a short one).
.PHONY: soak
soak:
	$(PY) bench/soak.py $(SOAK_ARGS)

# The main job on the embedded defaults, in the foreground until Ctrl-C: `codegym up` (library
# built from the sample environments on first run).
up:
	$(VENV)/bin/codegym up

# `codegym up` in the background on a free port, `codegym demo` against it, then everything stopped.
demo:
	@log=$$(mktemp); $(VENV)/bin/codegym up --port 0 >$$log 2>&1 & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid; rm -f $$log' EXIT; \
	for i in $$(seq 600); do grep -q "runtime listening on" $$log && break; \
	  kill -0 $$pid 2>/dev/null || { cat $$log; exit 1; }; sleep 0.1; done; \
	addr=$$(sed -n 's/^runtime listening on //p' $$log); test -n "$$addr" || { cat $$log; exit 1; }; \
	grep -v " INFO " $$log; $(VENV)/bin/codegym demo --target $$addr

# Each console page's load time in headless Chromium over a library of the published size and a
# large record (docs/console.md, "Load times"): `make bench-console CONSOLE_ARGS=--quick` (a smoke
# run); every option in `$(PY) bench/console_bench.py --help`.
.PHONY: bench-console
bench-console:
	$(PY) bench/console_bench.py $(CONSOLE_ARGS)

# The console's pages as PNGs in docs/console/ (docs/console.md shows them), each page's load time
# measured in headless Chromium on an idle stack over a library of 80,000 tasks (make install
# installs chromium and chromium-driver).
console-shots:
	$(PY) -m codegym_testkit.console_shots --out docs/console

# Kubernetes manifests: every kustomization under k8s/ (components aside) rendered with the kubectl
# that `make install` puts in the venv (pinned; kustomize is built in), then checked against the
# schemas of Kubernetes $(K8S_VERSION), unknown fields rejected.
K8S_VERSION := 1.33.0

k8s-validate:
	@out=$$(mktemp -d); trap 'rm -rf $$out' EXIT; \
	for k in $$(find k8s -name kustomization.yaml | sort); do \
	  grep -q '^kind: Component' $$k && continue; dir=$$(dirname $$k); file=$$out/$$(echo $$dir | tr / -).yaml; \
	  $(VENV)/bin/kubectl kustomize $$dir >$$file || exit 1; \
	  echo "rendered $$dir: $$(grep -c '^kind:' $$file) objects"; \
	done; \
	$(VENV)/bin/kubernetes-validate --strict --quiet --kubernetes-version $(K8S_VERSION) $$out/*.yaml && \
	echo "every rendered object is valid Kubernetes $(K8S_VERSION) (strict)"

docker-lint:
	$(VENV)/bin/hadolint Dockerfile

clean:
	rm -rf $(VENV) $(TRAINERS_VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
