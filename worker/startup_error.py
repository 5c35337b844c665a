"""The one error a worker's start-up raises for the user (worker/app.py, model_loading.py)."""

from __future__ import annotations


class StartupError(Exception):
    """The worker cannot start; the message says why, for the user. `settings`: those it is
    about that it names only as words (dtype, model), for the CLI to say where each came
    from (setting_sources.py; names like max_batch_size are found in the message)."""

    def __init__(self, message: str, settings: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.settings = settings
