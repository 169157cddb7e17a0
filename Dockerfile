# The image every node of cluster.yaml / cluster-p5.yaml runs Ray, the training workers and
# the tracking server in (docs/cluster.md, "Build the image"):
#
#     docker build -t mpipemoe:0.1.0 .
#
# CUDA torch (PyPI's Linux wheel of the pinned version carries its CUDA and NCCL libraries;
# the host brings the driver), libfabric with the EFA provider and the aws-ofi-nccl plugin
# (user space only: the AMI has the EFA kernel driver), Python 3.12 (Ubuntu 24.04), and this
# project with its cluster extras. tests/app/test_dockerfile.py checks the pins against the
# Makefile and pyproject.toml and builds the project's install from this file's COPY lines.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# The EFA installer of the AMI's release (`cat /opt/amazon/efa_installed_packages` on a node).
ARG EFA_INSTALLER_VERSION=1.47.0
ENV DEBIAN_FRONTEND=noninteractive

# hostname -I (the head's private IP), rsync and ssh (Ray's launcher), sudo (setup commands)
RUN apt-get update \
 && apt-get install -y -q --no-install-recommends python3 python3-venv curl ca-certificates \
        hostname rsync openssh-client sudo \
 && curl -fsSL https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz | tar xz -C /tmp \
 && cd /tmp/aws-efa-installer && ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
 && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*

# fi_info on PATH; NCCL finds the aws-ofi-nccl plugin (libnccl-net*.so) on LD_LIBRARY_PATH
ENV PATH=/opt/mpipemoe/venv/bin:/opt/amazon/efa/bin:$PATH
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib

RUN python3 -m venv /opt/mpipemoe/venv && pip install --no-cache-dir -q --upgrade pip
# torch first, pinned as the Makefile pins it (its own layer: the largest, the least changed)
RUN pip install --no-cache-dir -q "torch==2.13.0"

WORKDIR /opt/mpipemoe/src
COPY pyproject.toml README.md ./
COPY app app
COPY lm lm
COPY moe_engine moe_engine
COPY moe_sim moe_sim
COPY workers workers
COPY tune_spaces tune_spaces
# ray/mlflow/optuna pins (ray), the job server and EC2 client (cluster), PostgreSQL and S3
# clients of the tracking server (tracking-server), GPU metrics (system-metrics)
RUN pip install --no-cache-dir -q ".[ray,cluster,tracking-server,system-metrics]" \
 && python -m compileall -q /opt/mpipemoe/venv/lib > /dev/null

# Jobs ship their code with `ray job submit --working-dir .`, which shadows this copy.
WORKDIR /root
