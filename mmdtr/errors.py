"""The one error type of mmdtr."""


class MmdtrError(ValueError):
    """An mmdtr error: what went wrong, and a hint on how to fix it.

    Every message starts with ``mmdtr:``. It subclasses :class:`ValueError`
    so that bad configuration values can be caught the usual way.

    Args:
        message (str): What went wrong; name the key, the value and what is
            accepted.
        hint (str, optional): How to fix it.
    """

    def __init__(self, message: str, hint: str = ''):
        self.hint = hint
        text = f'mmdtr: {message}'
        if hint:
            text += f' Hint: {hint}'
        super().__init__(text)
