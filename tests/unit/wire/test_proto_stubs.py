"""The committed gRPC stubs (pagedserve/v1) describe exactly what proto/ says.

They are committed so that an installed wheel needs no generation step; this
compares their embedded descriptor with a fresh compile of the .proto (by
content, not by text, so a newer protoc's formatting does not matter).
Regenerate with ``make proto``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]  # (tests/unit/wire/)


def test_committed_stubs_match_the_proto(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from pagedserve.v1 import generation_pb2, generation_pb2_grpc

    out = tmp_path / "fresh.pb"
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--descriptor_set_out={out}",
                      str(ROOT / "proto" / "pagedserve" / "v1" / "generation.proto")])
    assert rc == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _clear_json_names(fresh.message_type)  # protoc fills json_name in descriptor sets; gencode leaves it out
    committed = descriptor_pb2.FileDescriptorProto.FromString(generation_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "pagedserve/v1 stubs are stale: run `make proto` and commit them"
    for service in fresh.service:
        servicer = getattr(generation_pb2_grpc, f"{service.name}Servicer")
        missing = [m.name for m in service.method if not hasattr(servicer, m.name)]
        assert not missing, f"generation_pb2_grpc lacks {missing}: run `make proto`"


def _clear_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)
