"""``vllm_api.init_checks`` on its own (no vLLM needed): the field checks both init infos of
the vLLM backend run at construction (the two classes: tests/real_vllm/test_init_info_checks.py)."""

import math

import pytest

from megatron_reshard.errors import BadInputError
from megatron_reshard.vllm_api import init_checks as checks
from megatron_reshard.wire.codec import decode_payload, encode_payload

CLS = "Info"


@pytest.mark.parametrize("ports,words", [
    ([70000], "Info.ports_by_stage[0]: expected an int in [1, 65535], found 70000 (int)"),
    ([0], "found 0 (int)"),
    ([], "(at least one stage), found [] (list)"),
    (["29600"], "found '29600' (str)"),
    ([True], "found True (bool)"),
    ([29600, 29601, 29600], "found port 29600 for stages 0 and 2"),
    ({"0": 29600, 0: 29601}, "expected each PP stage once, found stage 0"),
    ({-1: 29600}, "expected PP stage keys as ints >= 0, found -1 (int)"),
    ("29600", "expected a list (index = PP stage) or a dict"),
])
def test_ports_by_stage(ports, words):
    with pytest.raises(BadInputError) as err:
        checks.check_ports_by_stage(CLS, ports)
    assert words in str(err.value)


def test_good_values_pass():
    checks.check_ports_by_stage(CLS, [29600, 29601])
    checks.check_ports_by_stage(CLS, {"0": 29600, "1": 29601})  # JSON's dict keys
    checks.check_host(CLS, "node-0")
    checks.check_timeout_s(CLS, 0.5)
    checks.check_options(CLS, "opts", {"a": 1}, ["a", "b"])
    assert checks.check_payload(CLS, encode_payload({"schema_version": 1}), decode_payload) == {
        "schema_version": 1}


@pytest.mark.parametrize("value", [-1, 0, math.inf, math.nan, True, "5"])
def test_timeout_s(value):
    with pytest.raises(BadInputError, match=r"Info\.timeout_s: expected a finite number"):
        checks.check_timeout_s(CLS, value)


@pytest.mark.parametrize("host", ["", "   ", None, 3])
def test_host(host):
    with pytest.raises(BadInputError, match=r"Info\.host: expected a non-empty host name"):
        checks.check_host(CLS, host)


def test_options_name_the_unknown_and_the_reserved():
    with pytest.raises(BadInputError, match=r"unknown options \['c'\]; expected .* \['a'\]"):
        checks.check_options(CLS, "opts", {"c": 1}, ["a", "b"], reserved=["b"])
    with pytest.raises(BadInputError, match=r"\['b'\] are this init info's own fields"):
        checks.check_options(CLS, "opts", {"b": 1}, ["a", "b"], reserved=["b"])


def test_payload_bytes_that_do_not_decode_are_refused_with_their_size():
    with pytest.raises(BadInputError, match=r"Info\.payload: .* found 5 bytes that do not decode"):
        checks.check_payload(CLS, b"\x85\xa3abc", decode_payload)
    with pytest.raises(BadInputError, match=r"a map with 'schema_version'"):
        checks.check_payload(CLS, encode_payload({"x": 1}), decode_payload)
