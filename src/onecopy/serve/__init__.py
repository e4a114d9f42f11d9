"""Serve a onecopy program on Ray Serve (the optional extra `onecopy[serve]`).

    from ray import serve
    from onecopy.serve import deployment
    handle = serve.run(deployment("model.onecopy", replicas=2))
    (y,) = handle.remote("forward", [x]).result()

`replica.py` is the Ray Serve side (the replica class and the application); `server.py` what one replica does,
`codec.py` the HTTP formats, `sessions.py` the States of stateful methods, `batching.py` how requests are joined: those four need no Ray.
"""

from __future__ import annotations

from typing import Any

from onecopy.errors import InvalidArgument

__all__ = ["deployment"]


# The Ray side lives in `replica.py`, not a module named `deployment`: importing that would replace this function
# with the module as the package's attribute.
def deployment(program_path: Any, **options: Any) -> Any:
    """A Ray Serve application serving a program: see `onecopy.serve.replica.deployment`."""
    try:
        from onecopy.serve.replica import deployment as make
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] in ("ray", "starlette"):
            raise InvalidArgument(
                f"onecopy.serve needs Ray Serve ({e}); install it with pip install 'onecopy[serve]'."
            ) from e
        raise
    return make(program_path, **options)
