# The two commands: `make demo` and `make test`. Each sets up everything it needs (a .venv,
# torch, the other packages, the build) idempotently, then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP_LOUD := $(PY) -m pip --disable-pip-version-check
PIP    := $(PIP_LOUD) -q
# pip resolves torch to the CUDA build, which also runs on CPU-only machines.
DEPS   := "torch>=2.11" "transformers>=5.17,<6" "scikit-build-core>=0.10" "cmake>=3.26" ninja numpy \
          pytest hypothesis expecttest tqdm matplotlib accelerate fastapi uvicorn prometheus-client openai \
          "xgrammar>=0.2.9" jsonschema "torchao==0.18.0" "lm-eval[api]" schemathesis guidellm
# transformers' oldest supported release (with the dependency versions it resolves), installed
# beside the newest in a folder that goes first on PYTHONPATH, for a second integration run.
TF_OLDEST     := 5.17.0
TF_OLDEST_DIR := $(VENV)/transformers-$(TF_OLDEST)
# Python files too: an editable install maps the package's files when it is made.
SOURCES := $(shell find src_cuda minipaged_ops integration -type f -not -name '*.pyc') CMakeLists.txt pyproject.toml

.PHONY: demo test test-cpu-isas setup build bench bench-isas clean test-sanitize

demo: build
	$(PY) -m minipaged_ops.integration.demo

test: build $(TF_OLDEST_DIR)/.stamp
	$(PY) -m pytest tests
	$(MAKE) test-cpu-isas
	@echo "--- integration and engine tests again on transformers $(TF_OLDEST)"
	PYTHONPATH=$(TF_OLDEST_DIR) $(PY) -c "import transformers as t; assert t.__version__ == '$(TF_OLDEST)', t.__version__"
	PYTHONPATH=$(TF_OLDEST_DIR) $(PY) -m pytest tests -k "integration or engine" -p no:cacheprovider

# The op tests again under every other CPU kernel variant this CPU runs (the full run above used
# the best one), forced through MINIPAGED_CPU_ISA.
OP_TESTS := tests/test_paged_attention.py tests/test_paged_prefill.py tests/test_reshape_and_cache.py tests/test_op_errors.py \
            tests/test_quantized_kv.py tests/test_linear16.py
test-cpu-isas: build
	@for isa in $$($(PY) -c "import minipaged_ops as m; print(' '.join(m.supported_cpu_isas()[:-1]))"); do \
	  echo "--- op tests with MINIPAGED_CPU_ISA=$$isa"; \
	  MINIPAGED_CPU_ISA=$$isa $(PY) -m pytest $(OP_TESTS) -q -p no:cacheprovider -k "not cuda and not emu" || exit 1; \
	done

setup: $(VENV)/.deps-stamp

build: $(VENV)/.build-stamp

# The two long set-up steps print as they go (pip's download bars, then ninja's [n/N] lines) rather
# than sitting silent for minutes.
$(VENV)/.deps-stamp: Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "--- installing torch, transformers and the test/serving packages into $(VENV) (minutes on a fresh machine)"
	$(PIP_LOUD) install --progress-bar on $(DEPS)
	touch $@

$(VENV)/.build-stamp: $(VENV)/.deps-stamp $(SOURCES)
	@echo "--- building minipaged: the CPU kernels once per instruction set, the CUDA kernels where nvcc is found (minutes on 2 cores)"
	@bash -c 'set -o pipefail; $(PIP_LOUD) install -v --no-build-isolation --no-deps -e . 2>&1 \
	  | tee $(VENV)/build.log | { grep --line-buffered -E "^ *\[[0-9]+/[0-9]+\] |^ *-- minipaged:" || true; }' \
	  || { tail -n 40 $(VENV)/build.log; echo "build failed: the whole log is $(VENV)/build.log"; exit 1; }
	@$(PY) -c "import minipaged_ops; print('minipaged:', minipaged_ops.build_info())"
	touch $@

$(TF_OLDEST_DIR)/.stamp: $(VENV)/.deps-stamp
	rm -rf $(TF_OLDEST_DIR)
	$(PIP) install --target $(TF_OLDEST_DIR) transformers==$(TF_OLDEST)
	touch $@

bench: build
	$(PY) bench/decode_cpu.py
	$(PY) bench/block_manager.py

# Issue 39's figures under every CPU kernel variant this CPU runs, one child process per variant
# (bench/common.py run_per_isa): prefill against SDPA, decode against a sum over the same bytes and
# the 8-bit caches against bfloat16's, at the CPU's default block size.
ISA_DECODE := --isa all --block-size 64 --dtype float32,bfloat16 --kv-cache-dtype int8,fp8_e4m3,fp8_e5m2
bench-isas: build
	$(PY) bench/prefill.py --isa all --block-size 64
	$(PY) bench/decode_cpu.py $(ISA_DECODE)
	$(PY) bench/decode_cpu.py $(ISA_DECODE) --batch 1 --seq-len 32768

clean:
	rm -rf build $(VENV)

# The emulated CUDA op tests under ASan+UBSan, then TSan (tests/sanitize.py; ~20 min on 2 cores, not in CI).
test-sanitize: build
	$(PY) tests/sanitize.py
