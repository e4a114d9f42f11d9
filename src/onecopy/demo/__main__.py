"""`python -m onecopy.demo KIND ARGS`: one of the demo's fresh processes (see onecopy.demo.children)."""

import sys

from onecopy.demo.children import main

main(sys.argv[1:])
