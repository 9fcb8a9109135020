"""Run by the installed package's own Python (tests/packaging/test_wheel.py), from a
folder outside the checkout: one request through each API of the server at argv[1]
(HTTP) and argv[2] (gRPC), with the gRPC code the wheel shipped. Prints one JSON
object: where pdserve was imported from and what each API answered."""

import json
import sys
import urllib.request

import grpc

import pdserve
from pdserve.protos import pb, pb_grpc


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def main() -> None:
    http, grpc_addr, model = sys.argv[1:4]
    greedy = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = post(f"{http}/v1/completions", {**greedy, "prompt": [5, 6, 7, 8],
                                                     "return_token_ids": True})
    chat = post(f"{http}/v1/chat/completions",
                {**greedy, "messages": [{"role": "user", "content": "hello"}]})
    with grpc.insecure_channel(grpc_addr) as channel:
        replies = list(pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                               params=pb.SamplingParameters(max_tokens=4, ignore_eos=True)),
            timeout=120))
    print(json.dumps({
        "pdserve": pdserve.__file__,
        "protos": pb.__file__,
        "completion": completion,
        "chat": chat,
        "grpc_tokens": [t for r in replies if r.HasField("chunk") for t in r.chunk.token_ids],
        "grpc_final": [r.final.finish_reason for r in replies if r.HasField("final")],
    }))


if __name__ == "__main__":
    main()
