"""The error table: the message of a request with several invalid fields counts the others in words,
and the router's 404/405 become errors of the table (the app's answers are in tests/http/test_app.py)."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidRequest, MethodNotAllowed, NotFound, from_routing, status_for
from service.wire.schemas import parse_request

VALID = '"input_ids": [[1, 2]], "num_actions": 1'


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('"temperature": "hot"', "temperature: Input should be a valid number"),
        (
            '"temperature": "hot", "kl_estimator": "k9"',
            "temperature: Input should be a valid number (and 1 more error)",
        ),
        (
            '"temperature": "hot", "kl_estimator": "k9", "return_entropy": 3',
            "temperature: Input should be a valid number (and 2 more errors)",
        ),
    ],
)  # fmt: skip
def test_further_errors_are_counted_in_words(extra: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(f"{{{VALID}, {extra}}}".encode())
    assert refused.value.message == message
    assert refused.value.field == "temperature"


def test_the_router_statuses_are_rows_of_the_table() -> None:
    missing = from_routing(404, "GET", "/", None)
    assert isinstance(missing, NotFound)
    assert status_for(missing) == 404
    wrong = from_routing(405, "GET", "/logprobs", "POST")
    assert isinstance(wrong, MethodNotAllowed)
    assert status_for(wrong) == 405
    assert wrong.headers() == {"Allow": "POST"}
    assert from_routing(400, "GET", "/", None) is None  # not the router's: FastAPI's own answer
