#!/usr/bin/env python3
"""Calls NodeUnprepareResources on a DRA plugin's socket, as the kubelet does when a claim's last pod goes.

    unprepare.py SOCKET NAMESPACE/NAME/UID...

Prints each claim's answer as `UID ok` or `UID error: ...`; exit 0 when every claim succeeded. The stubs are
generated from proto/dra/v1/api.proto at run time (pip install grpcio grpcio-tools).
"""
import importlib
import os
import sys
import tempfile

from grpc_tools import protoc
import grpc

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def stubs():
    out = tempfile.mkdtemp()
    proto_dir = os.path.join(ROOT, "proto")
    code = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
                        os.path.join(proto_dir, "dra", "v1", "api.proto")])
    if code != 0:
        sys.exit("generating the gRPC stubs failed")
    sys.path.insert(0, os.path.join(out, "dra", "v1"))
    sys.path.insert(0, out)
    return importlib.import_module("dra.v1.api_pb2"), importlib.import_module("dra.v1.api_pb2_grpc")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    socket, refs = sys.argv[1], sys.argv[2:]
    pb, pb_grpc = stubs()
    claims = []
    for ref in refs:
        namespace, name, uid = ref.split("/")
        claims.append(pb.Claim(namespace=namespace, name=name, uid=uid))
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.DRAPluginStub(channel)
        answer = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=claims), timeout=45)
    failed = 0
    for claim in claims:
        error = answer.claims[claim.uid].error if claim.uid in answer.claims else "no answer"
        print(f"{claim.uid} {'ok' if not error else 'error: ' + error}")
        failed += bool(error)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
