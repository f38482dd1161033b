# vLLM's router (the vLLM project's Rust load balancer, the prebuilt `vllm-router` wheel) in front of the inference nodes.
# Build from the repository root: docker build -f deploy/docker/router.Dockerfile -t ghcr.io/inferscale/vllm-router:0.1.17 .
# The release the fleet tests run (pyproject's test extra): the routing, retries and metrics deploy/README.md describes
# are this one's. It needs nothing of InferScale's own code.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --gid 10001 router && useradd --uid 10001 --gid 10001 --no-create-home router \
    && pip install vllm-router==0.1.17

USER 10001:10001
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
