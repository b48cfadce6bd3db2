{
  description = "pallas-tpu-kernels: Pallas TPU kernels for PyTorch on the Hugging Face Kernels Hub";

  # kernel-builder convention: one genKernelFlakeOutputs per kernel. Each kernel's kernel-builder
  # source tree (build.toml, flake.nix, torch-ext/<package>/) is generated from kernels/<name> and
  # torch-ext/ by `python scripts/build.py` into dist/<hub-name>/, so build first.
  # Nix cannot run in this project's CI (no network for the kernel-builder input), and upstream
  # Nix support for TPU is experimental (TPU builds are excluded from `bundle`): the Hub repos are
  # assembled by scripts/build.py, and this flake is kept for kernel-builder users and checked
  # only for syntax (`nix-instantiate --parse flake.nix`).

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    let
      kernelNames = [
        "ragged-dot-tpu"
        "flash-attention-tpu"
        "paged-attention-tpu"
      ];
      kernelOutputs =
        name:
        kernel-builder.lib.genKernelFlakeOutputs {
          inherit self;
          path = ./dist + "/${name}";
        };
    in
    {
      kernels = builtins.listToAttrs (
        map (name: {
          inherit name;
          value = kernelOutputs name;
        }) kernelNames
      );
    };
}
