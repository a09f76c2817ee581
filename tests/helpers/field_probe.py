"""What the request-field tests ask of a call, whatever the route: refused naming a field, failed with an
error, or logged. A subclass defines `call(**body)`, the route's request through the official client."""

from __future__ import annotations

import logging

import openai
import pytest


class FieldProbe:
    """Mixed into a route's test client, which defines `call(**body)`."""

    def refused(self, param: str, **body) -> bool:
        """A 400 whose `param` is `param` and whose message names it."""
        with pytest.raises(openai.BadRequestError) as bad:
            self.call(**body)
        assert bad.value.body["param"] == param and param in bad.value.body["message"], bad.value.body
        return True

    def fails(self, error: type[Exception], **body) -> bool:
        with pytest.raises(error):
            self.call(**body)
        return True

    def logged(self, caplog, words: str, level=logging.INFO, **body) -> bool:
        """The ingress logged `words` (at `level` or above) while answering."""
        with caplog.at_level(level, logger="tandem.ingress"):
            self.call(**body)
        return any(words in r.getMessage() for r in caplog.records if r.levelno >= level)
