"""Errors that the command line reports as one clear line instead of a stack trace."""


class C2KDError(Exception):
    """A problem with the user's input or files; the message says which file/field and what was expected."""


class DataError(C2KDError, ValueError):
    """Bad input data; the message names the file, row and field."""


class CacheError(C2KDError):
    """A teacher cache that is missing, incomplete, corrupted or does not fit the caller."""
