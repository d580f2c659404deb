"""`vllm serve file.gguf` without --served-model-name serves the model under the argument as
given: /v1/models lists it, requests naming it are answered, /metrics labels it. (The
platform resolves the argument to a prepared directory, which vLLM's front end would
otherwise take as the name: requests for the file's path got a 404.)"""

from __future__ import annotations

import pytest

from vllm_metal.models.offline import OFFLINE_GGUF


def serve_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_metal.platform import MetalPlatform

    top = FlexibleArgumentParser()
    serve = make_arg_parser(top.add_subparsers(dest="subparser").add_parser("serve"))
    MetalPlatform.pre_register_and_update(serve)  # idempotent when vLLM already called it
    return top


def test_the_name_is_the_argument_as_given(tmp_path, monkeypatch):
    gguf = OFFLINE_GGUF["smollm2"]()
    link = tmp_path / "m.gguf"
    link.symlink_to(gguf)
    monkeypatch.chdir(tmp_path)
    parser = serve_parser()
    args = parser.parse_args(["serve", "m.gguf"])
    assert args.model_tag != "m.gguf" and args.served_model_name == ["m.gguf"]
    args = parser.parse_args(["serve", "--model", str(gguf)])
    assert args.served_model_name == [str(gguf)]
    assert parser.parse_args(["serve", "m.gguf", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    # the tokenizer argument, the same file spelled otherwise, does not rename the model
    assert parser.parse_args(["serve", "m.gguf", "--tokenizer", str(gguf)]).served_model_name == ["m.gguf"]
    assert parser.parse_args(["serve", str(tmp_path)]).served_model_name is None  # a directory: vLLM's rule


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serve_answers_requests_for_the_file_it_was_given():
    from serving_harness import Server

    gguf = str(OFFLINE_GGUF["smollm2"]())
    server = Server(gguf, None, ["--max-model-len", "256", "--num-gpu-blocks-override", "32"])
    try:
        assert [m["id"] for m in server.client.get("/v1/models").json()["data"]] == [gguf]
        r = server.client.post("/v1/completions", json={"model": gguf, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert f'model_name="{gguf}"' in server.client.get("/metrics").text
    finally:
        server.stop()
