"""The one exception type for mistakes a user can fix; the CLI prints it as one line."""


class SpecbenchError(Exception):
    """Bad input (unknown name, malformed file, impossible setting): shown without a traceback."""
