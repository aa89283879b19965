# The xpuscope agent image for deploy/kubernetes/daemonset.yaml, built from
# this repository:
#
#   docker build -t xpuscope-agent:0.1.0 .
#
# Stage 1 builds the Debian package as a release does (`cargo xtask
# package`: nightly with rust-src and bpf-linker for the eBPF programs,
# embedded in the release agent); stage 2 installs that package on Debian
# 12 (same glibc), exactly as deploy/docker/Dockerfile.package does from a
# package built elsewhere (and offline, from a local base). The DaemonSet
# mounts its own configuration over /etc/xpuscope.
FROM rust:1.95-bookworm AS build
# The toolchains the project is built with (docs/src/development/toolchain.md):
# stable 1.95 for user space; for the kernel programs the nightly whose
# rustc is 1.97.0-nightly (e50aa6fba 2026-05-19), LLVM 22, which bpf-linker
# is built against. xtask calls it `+nightly`: installed dated, then given
# that name.
ARG NIGHTLY=nightly-2026-05-20
RUN rustup toolchain install "$NIGHTLY" --profile minimal --component rust-src \
    && cd "${RUSTUP_HOME:-$HOME/.rustup}/toolchains" \
    && mv "$NIGHTLY-x86_64-unknown-linux-gnu" nightly-x86_64-unknown-linux-gnu \
    && rustc +nightly --version | grep -q 1.97.0-nightly
WORKDIR /src
COPY . .
RUN cargo xtask package

FROM debian:bookworm-slim
COPY --from=build /src/target/debian/xpuscope_*_amd64.deb /tmp/
RUN apt-get update \
    && apt-get install -y --no-install-recommends /tmp/xpuscope_*_amd64.deb \
    && rm -f /tmp/xpuscope_*_amd64.deb \
    && rm -rf /var/lib/apt/lists/* \
    && /usr/bin/agent --version
# Root, with the capabilities the DaemonSet grants (no more).
ENTRYPOINT ["/usr/bin/agent"]
CMD ["service", "--config", "/etc/xpuscope/agent.toml"]
