"""Session setup shared by every test module.

torchvision's Python modules must be importable before anything imports transformers or
timm, even where the installed torchvision's compiled ops were built for another torch
(see ``tests.real_models.ensure_torchvision_importable``, which spawned workers also run
when they import the model zoo).
"""

import os

# compshard's compile cache lives in torch's AOTAutograd cache (docs/caching.md): off for the suite, so that no
# test loads a schedule that another test, an earlier run or a patched pass compiled. test_compile_cache turns it on.
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

from tests.real_models import ensure_torchvision_importable  # noqa: E402

ensure_torchvision_importable()
