"""User-facing errors. The CLI prints `error: <message>` (one line) and exits 2;
RETROGRAD_DEBUG=1 shows the traceback instead."""


class RetrogradError(Exception):
    """A problem with the user's input that they can fix; the message is the whole story."""


class GGUFError(RetrogradError):
    """The model file is missing, unreadable, not GGUF, damaged, or holds something we cannot use."""


class UnsupportedArchError(GGUFError):
    pass


class ConfigError(RetrogradError):
    pass


class DataError(RetrogradError):
    pass


class DeviceError(RetrogradError):
    pass


class TrainingDiverged(RetrogradError):
    """The loss or the KL to the reference stopped being finite or sane. The run stops
    before the adapter takes the step, its checkpoints stay as they are, and the exit
    status is 1: the input was valid, the optimisation failed."""

    exit_code = 1
