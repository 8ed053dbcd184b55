"""Session setup shared by every test module.

torchvision's Python modules must be importable before anything imports transformers or
timm, even where the installed torchvision's compiled ops were built for another torch
(see ``tests.real_models.ensure_torchvision_importable``, which spawned workers also run
when they import the model zoo).
"""

from tests.real_models import ensure_torchvision_importable

ensure_torchvision_importable()
