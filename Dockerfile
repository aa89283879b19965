# The xpuscope agent image for deploy/kubernetes/daemonset.yaml, built from
# this repository:
#
#   docker build -t xpuscope-agent .
#
# Stage 1 does what `cargo xtask install` does on a node (nightly with
# rust-src and bpf-linker for the eBPF programs, embedded in the release
# agent), staged under /stage; stage 2 is the agent and its default
# configuration on Debian 12 (same glibc). The DaemonSet mounts its own
# configuration over /etc/xpuscope.
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
RUN cargo xtask install --root /stage

FROM debian:bookworm-slim
COPY --from=build /stage/usr/local/bin/agent /usr/local/bin/agent
COPY --from=build /stage/etc/xpuscope/agent.toml /etc/xpuscope/agent.toml
# Root, with the capabilities the DaemonSet grants (no more).
ENTRYPOINT ["/usr/local/bin/agent"]
CMD ["service", "--config", "/etc/xpuscope/agent.toml"]
