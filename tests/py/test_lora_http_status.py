"""lora/http_status.py: vLLM's 500 for a refused adapter becomes a 400 with the same
message; every other answer of load_lora_adapter is left as vLLM made it. (The served
path, the wrap installed in `vllm serve`'s API server: test_serving_lora.py.)"""

from __future__ import annotations

from http import HTTPStatus

from vllm.entrypoints.serve import create_error_response

from vllm_metal.lora.http_status import REFUSED, as_bad_request


def error(message, status, err_type="InternalServerError"):
    return create_error_response(message=message, err_type=err_type, status_code=status)


def test_a_refusal_of_ours_becomes_a_400_with_its_message():
    msg = f"{REFUSED}'big' (/a): q_proj: rank 32 exceeds --max-lora-rank 16"
    got = as_bad_request(error(msg, HTTPStatus.INTERNAL_SERVER_ERROR), create_error_response)
    assert got.error.code == 400 and got.error.message == msg
    assert got.error.type == "BadRequestError"


def test_other_answers_are_left_alone():
    other = error("engine dead", HTTPStatus.INTERNAL_SERVER_ERROR)
    assert as_bad_request(other, create_error_response) is other
    missing = error(f"{REFUSED}'x' not found", HTTPStatus.NOT_FOUND, "NotFoundError")
    assert as_bad_request(missing, create_error_response) is missing
    ok = "Success: LoRA adapter 'a' added successfully."
    assert as_bad_request(ok, create_error_response) is ok
