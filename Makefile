# Two commands do everything: `make demo` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint bench bench-bf16 bench-precision bench-shapes bench-single clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/partune tune bert-small -o plan.json
	$(BIN)/partune run bert-small --plan plan.json

# Two processes share the tests (pytest-xdist): most of them wait on measuring workers or
# compilers, and CI has two cores. Tests that share a costly module fixture keep one process
# (``xdist_group``).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# ruff, the layer contract (type-only imports counted), and the architecture test: every
# module placed, no circles, no private names reached, modules and functions short.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests/test_architecture.py

# The emitted plan against onnxruntime, OpenVINO and torch.compile, zoo + ONNX exports, at one
# thread and at every core, then the held-out architectures on their own (hours); last, each
# export's headroom (the most any f32 plan could gain), beside the plans just measured.
bench: $(STAMP)
	$(BIN)/python experiments/bench_vs_peers.py
	$(BIN)/python experiments/bench_vs_peers.py --threads all --out experiments/results/vs_peers_all_cores.md
	$(BIN)/python experiments/bench_vs_peers.py --held-out
	$(BIN)/python experiments/bench_vs_peers.py --held-out --threads all --out experiments/results/vs_peers_held_out_all_cores.md
	$(BIN)/python experiments/bench_headroom.py
	$(BIN)/python experiments/bench_headroom.py --threads $$(nproc) --out experiments/results/headroom_all_cores.md

# bf16 regions within a 1e-2 relative-error budget, against the f32 plan and the peers at that
# budget (shares the f32 benchmark's store: run after `make bench`).
bench-bf16: $(STAMP)
	$(BIN)/python experiments/bench_bf16.py
	$(BIN)/python experiments/bench_bf16.py --threads all

# Mixed precision (int8, bf16, f32 regions) within a 1e-2 relative-error budget, against the
# fastest f32 peer and the fastest peer that budget allows (onnxruntime and OpenVINO int8 count
# only within it); at one thread and at every core, in a store of its own.
bench-precision: $(STAMP)
	$(BIN)/python experiments/bench_precision.py
	$(BIN)/python experiments/bench_precision.py --threads all

# One job over the shapes users serve (--shapes): the verdict per tuned point, the buckets' search
# time against the largest point alone, and the deployed artifact served between and beyond them.
bench-shapes: $(STAMP)
	$(BIN)/python experiments/bench_shapes.py
	$(BIN)/python experiments/bench_shapes.py --threads all

bench-single: $(STAMP)
	$(BIN)/python experiments/bench_single_backends.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
