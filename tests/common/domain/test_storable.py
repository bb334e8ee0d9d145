"""What a request body may carry: valid Unicode text and finite numbers, at any depth, keys included."""

from __future__ import annotations

import pytest

from common.domain import storable


@pytest.mark.parametrize("raw", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e999}',
                                 '[1, 2, -1e400]'])
def test_loads_refuses_what_is_not_a_finite_number(raw: str) -> None:
    with pytest.raises(ValueError):
        storable.loads(raw)


def test_loads_keeps_ordinary_json() -> None:
    assert storable.loads(b'{"a": [1, 2.5, -3e10, "\\u00e9", null, true], "b": {"c": 10000000000000000000000}}') == {
        "a": [1, 2.5, -3e10, "é", None, True], "b": {"c": 10**22}}


@pytest.mark.parametrize(("value", "where"), [
    ({"metadata": {"note": "x\udc00"}}, "metadata.note"),
    ({"messages": [{"content": [{"text": "ok"}, {"text": "\ud800"}]}]}, "messages.0.content.1.text"),
    ({"stop": ["a", "\udfff"]}, "stop.1"),
    ({"metadata": {"k\ud800": 1}}, "a key in metadata"),
    ({"temperature": float("nan")}, "temperature"),
    ({"metadata": {"x": [float("inf")]}}, "metadata.x.0"),
])
def test_check_names_where_the_unstorable_value_is(value: object, where: str) -> None:
    with pytest.raises(storable.UnstorableValue) as caught:
        storable.check(value)
    message = str(caught.value)
    assert where in message
    message.encode("utf-8")  # the message itself can always be written out


def test_check_accepts_any_valid_text_and_refuses_deep_nesting() -> None:
    storable.check({"text": "NUL \x00, emoji \U0001f600, CJK 漢字, RTL \u202e", "n": [1, 2.5, None, True]})
    deep: object = 1
    for _ in range(storable.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(storable.UnstorableValue, match="nested more than"):
        storable.check(deep)
    assert storable.is_valid_text("é") and not storable.is_valid_text("\udc80")
