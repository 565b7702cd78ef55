# Every target installs what it needs into .venv first: training from requirements.txt, tests and benches also from
# requirements-dev.txt. Where torch is already importable (GPU images) the venv sees it instead of reinstalling it, so
# nothing here calls a console script (torchrun, pytest, ruff) the venv may not own: always `python -m ...`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
NGPU   := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
RUN    ?= runs/$(if $(filter 0,$(NGPU)),tiny,small)
# FineWeb shards of ~98.5M GPT-2 tokens for the GPU run: one per GPU covers its 2,000 steps of 32 x 1,024 tokens
SHARDS ?= $(NGPU)
CORE   := test_config test_model test_mesh test_comm test_layers test_structure test_attention_kernels \
          test_ddp test_fsdp test_tp test_cp test_pp test_ckpt test_train

# The GPT-2 (124M) speedrun's target, on every GPU of one node: val loss 3.28 on FineWeb's first 10,485,760
# val tokens (GPT-2 tokens). The recipe of the plain-AdamW entry: 2^19 tokens a step, lr 0.0018, 250 warmup
# steps, a linear warm-down over the last 2,000, betas (0.9, 0.95); 9,536 steps are 5.0B tokens (52 shards).
GPT2   := --model small --dtype bf16 --compile --steps 9536 --global-batch 512 --micro-batch 32 --lr 0.0018 \
          --min-lr 0 --warmup 250 --schedule wsd --warmdown 2000 --eval-every 250 --eval-tokens 10485760 \
          --target-loss 3.28 --log-every 50 --save-every 1000

.PHONY: install install-dev train gpt2 sample test test-core bench bench-quick vs-peers lint clean

$(VENV)/.run: requirements.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.run requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

install: $(VENV)/.run
install-dev: $(VENV)/.dev

data/pystdlib/meta.json: | install
	$(PY) -m data.prepare pystdlib

# CPU: the tiny model on the offline corpus for about 3.5 minutes. GPU node: the small model on every GPU, bf16,
# compiled, on FineWeb (GPT-2 tokens) where the network reaches it, else on the offline corpus, saying why.
train: install
ifeq ($(NGPU),0)
	$(MAKE) --no-print-directory data/pystdlib/meta.json
	$(PY) train.py --model tiny --steps 400 --global-batch 32 --micro-batch 16 --lr 3e-3 --warmup 20 \
		--eval-every 100 --log-every 50 --save-every 100 --out $(RUN) --metrics $(RUN)/metrics.jsonl --resume auto
else
	data=$$($(PY) -m data.prepare fineweb10b --shards $(SHARDS) --fallback pystdlib --print-folder) && \
	$(PY) -m parallel.launch --standalone --nproc_per_node $(NGPU) train.py --data $$data --model small \
		--dtype bf16 --compile --steps 2000 --global-batch $$((32 * $(NGPU))) --micro-batch 16 --lr 1e-3 \
		--min-lr 1e-4 --warmup 100 --eval-every 250 --log-every 50 --save-every 500 --out $(RUN) \
		--metrics $(RUN)/metrics.jsonl --resume auto
endif

gpt2: install
	@if [ "$(NGPU)" = 0 ]; then echo "make gpt2: needs the GPUs of a node; none is visible" >&2; exit 2; fi
	data=$$($(PY) -m data.prepare fineweb10b --shards 52 --print-folder) && \
	$(PY) -m parallel.launch --standalone --nproc_per_node $(NGPU) train.py --data $$data $(GPT2) \
		--out runs/gpt2 --resume auto

sample: install
	$(PY) sample.py --run $(RUN) --prompt "def " --max-new-tokens 300 --temperature 0.8 --top-k 40

# The whole suite (CI runs it), and the core's for someone changing one parallelism (about 6.5 minutes on 2 cores).
test: install-dev
	$(PY) -m pytest -q --durations=10 tests

test-core: install-dev
	$(PY) -m pytest -q $(addprefix tests/,$(addsuffix .py,$(CORE)))

# Every bench script this machine can run, a line as each starts and ends, tables into bench/results (about 18 minutes
# on 2 quiet CPU cores, 4 more as root for the emulated cluster); bench-quick: each at smoke-test sizes, into
# out/bench-quick (about 5 minutes).
bench: install-dev data/pystdlib/meta.json
	$(PY) -m bench.run_all
	$(MAKE) vs-peers

# One step of Llama 3 8B on FSDP 8, ours beside torch's FSDP2 and torchtitan's, counted on fake H100s (about a minute
# on 2 cores; LAYOUT=... CKPT=full for another row, python -m bench.vs_peers --list names them). torchtitan and its
# imports go into .torchtitan, on top of .venv's torch (--no-deps: a resolver would replace that torch).
LAYOUT ?= 8b-fsdp8
CKPT   ?= op
.torchtitan/.done: requirements-torchtitan.txt | install-dev
	$(PIP) --no-deps --target .torchtitan -r requirements-torchtitan.txt
	touch $@

vs-peers: install-dev .torchtitan/.done
	PYTHONPATH=.torchtitan $(PY) -m bench.vs_peers --layout $(LAYOUT) --ckpt $(CKPT)

bench-quick: install-dev data/pystdlib/meta.json
	$(PY) -m bench.run_all --quick

lint: install-dev
	$(PY) -m ruff check .

clean:
	rm -rf out runs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
