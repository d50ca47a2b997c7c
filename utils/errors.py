"""User-facing error types.

Every problem a user can fix (a bad flag, a missing file, an odd mask, a broken checkpoint) is raised as a
``UserError`` whose message names the flag or file and says what to do. Entry scripts catch ``UserError`` and turn it
into one line on stderr and a non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message names the file or flag and the fix."""


class ConfigError(UserError):
    """A flag or flag combination is invalid."""


class DatasetError(UserError):
    """The image or mask folders cannot be used as they are."""


class CheckpointError(UserError):
    """A checkpoint file is missing, corrupt, unsafe or does not fit the model."""


# Exit status used by entry scripts for user errors (argparse uses 2 for bad flags too).
USER_ERROR_EXIT_CODE = 2
