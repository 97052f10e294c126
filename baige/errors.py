"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class BaigeError(Exception):
    """A user-facing error: bad path, bad config, bad checkpoint, bad request.

    The message is one line that names the bad thing; the CLI prints it without a traceback.
    ``param``, when set, is the request field or option it concerns (the server's error ``param``).
    """

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param
