"""The library bodies of the commands, under the CLI and over everything else.

Each command is ``start -> world -> pipeline call -> render``: the CLI reads the recipe, joins
the world and renders; what happens in between lives here, once, for the CLI, the tests and
``bench/``. ``model.build`` holds the order in which a model becomes a rank's model.
"""

from qckpt.pipeline.hooks import SILENT, Hooks

__all__ = ["SILENT", "Hooks"]
