"""The one exception type users see: bad input, unusable models, impossible settings."""


class SpecMTPError(Exception):
    """A problem with the user's input or environment, reported as one line by the CLI."""
