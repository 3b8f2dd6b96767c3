"""The one error type of mmdtr."""


class MmdtrError(ValueError):
    """An mmdtr error: what went wrong, and a hint on how to fix it.

    Every message starts with ``mmdtr:``. It subclasses :class:`ValueError`
    so that bad configuration values can be caught the usual way.

    Args:
        message (str): What went wrong; name the key, the value and what is
            accepted.
        hint (str, optional): How to fix it.

    Attributes:
        message (str): ``message`` as given, without the prefix, so that a
            caller can wrap it and keep the hint apart.
        hint (str): ``hint`` as given.
    """

    def __init__(self, message: str, hint: str = ''):
        self.message, self.hint = message, hint
        text = f'mmdtr: {message}'
        if hint:
            text += f' Hint: {hint}'
        super().__init__(text)

    def __reduce__(self):
        # rebuilt from its parts: from the text, a copy or an unpickled
        # error (a worker's, a rank's) read "mmdtr: mmdtr: ..."
        return type(self), (self.message, self.hint), self.__dict__
