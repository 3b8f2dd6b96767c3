"""Work dirs of the tools, checked before anything is written to them."""
import os
import os.path as osp

from mmdtr.errors import MmdtrError


def check_work_dir(work_dir, key: str = '--work-dir') -> None:
    """Refuse a work dir that cannot be made: a file, or under one.

    Args:
        work_dir (str): The work dir.
        key (str): Where it was given, for the message.

    Raises:
        MmdtrError: If ``work_dir`` is not a path, or it or its nearest
            existing ancestor is not a writable directory.
    """
    if not isinstance(work_dir, str) or not work_dir:
        raise MmdtrError(
            f'{key} {work_dir!r} is not a directory path.',
            hint='e.g. --work-dir work_dirs/run1.')
    existing = osp.abspath(work_dir)
    while not osp.exists(existing):
        existing = osp.dirname(existing)
    if not osp.isdir(existing):
        where = 'is' if existing == osp.abspath(work_dir) else 'is under'
        raise MmdtrError(
            f'{key} {work_dir!r} {where} the file {existing!r}; a work dir '
            'must be a directory.',
            hint='give a directory path, e.g. --work-dir work_dirs/run1.')
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MmdtrError(
            f'{key} {work_dir!r} cannot be made: {existing!r} is not '
            'writable.',
            hint='give a directory you can write to.')
