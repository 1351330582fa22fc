#!/usr/bin/env bash
# GPU runs for overdrive.engine on the lent H200, in four calls of under 10 minutes each (parts 1-3 took
# 16 minutes on 2026-12-01; part 4 has not been run); every step has its own time limit, and results land in
# benchmarks/results/ (and $OUT when set).
#   bash scripts/gpu_engine.sh 1   # gpu tests; ResNet-50 fp16/fp8 engines (+ fp16:hwc I/O)
#   bash scripts/gpu_engine.sh 2   # the mask pass on BERT (engine_mask); BERT engines with and without a mask
#                                  # input, each also with --gemm-gelu
#   bash scripts/gpu_engine.sh 3   # --timing-cache rebuild time; int8 ResNet-50; batch 1 with freezing
#   bash scripts/gpu_engine.sh 4   # BERT input_ids only in fp8 (+ --gemm-gelu); cuDNN fused conv epilogues vs Inductor
#   bash scripts/gpu_engine.sh 5   # the CNN rows of the zoo with the one-graph runner, eager and int8/fp8 included
#                                  # (not yet run: the 2026-12-04 zoo has their fp16 rows only)
#   bash scripts/gpu_engine.sh 6   # int8/fp8 CNN engines: their GPU tests; ResNet-50 fp16/int8/fp8 with the build
#                                  # phases (8-bit residuals, kernels compiled in threads: not yet run)
#   bash scripts/gpu_engine.sh 7   # where the fp8 ResNet-50 engine's time goes (profile); EfficientNet-B0 int8/fp8
#   bash scripts/gpu_engine.sh 8   # per-layer speed at ResNet-50's shapes: int8/fp8 and fp16 Triton against cuDNN
#                                  # (the SiLU/GELU and persistent-tile GPU tests passed on 2026-12-04)
#   bash scripts/gpu_engine.sh 9   # the conv passes' GPU tests; the demo's ResNet-18 engines with the stem padded
#   bash scripts/gpu_engine.sh 10  # ResNet-50 and EfficientNet-B0 fp16/int8/fp8 with convolutions judged at margin 1.0
#   bash scripts/gpu_engine.sh 10  # (run 2026-12-04: engine_zoo_cnn_margin)
#   bash scripts/gpu_engine.sh 11  # ConvNeXt's int8/fp8 engines and the CNNs' int8/fp8 at batch 1 (the zoo's "not run")
#   bash scripts/gpu_engine.sh 12  # layer-choice GPU tests; ResNet-50 and EfficientNet-B0 int8/fp8 with re-planning
#                                  # (run 2026-12-05: engine_zoo_cnn_replan)
#   bash scripts/gpu_engine.sh 13  # whole-engine timing: its GPU tests; ResNet-50 int8/fp8 (run 2026-12-05 on an H100:
#                                  # engine_zoo_resnet50_whole; first run on the H200 with the
#                                  # dequantized twin: engine_zoo_cnn_whole; EfficientNet-B0 ran past the limit)
#   bash scripts/gpu_engine.sh 14  # EfficientNet-B0 int8/fp8 with the whole-engine timing (run 2026-12-05, H200, 238 s:
#                                  # engine_zoo_effnet_whole)
#   bash scripts/gpu_engine.sh 15  # the GEMM form of the int8/fp8 kernel and Linear layers on it: GPU tests, then
#                                  # benchmarks/lowp_linear.py (transformer GEMMs with their epilogues)
#   bash scripts/gpu_engine.sh 16  # ViT-B/16 fp16/int8/fp8 engines with the Linear layers timed three ways (Triton with
#                                  # the epilogue fused, cuBLAS, float): engine_zoo_vit_linear
#   bash scripts/gpu_engine.sh 17  # the Llama-style decoder likewise: engine_zoo_llama_linear
#   bash scripts/gpu_engine.sh 18  # BERT-base at 32x128 likewise: engine_zoo_bert_linear
#   bash scripts/gpu_engine.sh 19  # where the transformer engines' GPU time goes: ViT-B/16 and the Llama-style decoder
#                                  # fp16/int8/fp8 with --kernel-time (kernel groups and top kernels per row, and each
#                                  # layer's verdict, in the JSON): engine_zoo_tf_kernels
#   bash scripts/gpu_engine.sh 20  # ResNet-50 fp16/int8/fp8 engines with the GEMM form on its 1x1 layers, --kernel-time:
#                                  # engine_zoo_resnet50_gemm
#   bash scripts/gpu_engine.sh 21  # every gpu-marked test (-n 4); the CNNs' int8/fp8 engines at batch 1 beside their
#                                  # fp16 engine (the zoo's "not run" rows): engine_zoo_cnn_bs1_lowp
#   bash scripts/gpu_engine.sh 22  # sibling int8/fp8 GEMMs as one (Q/K/V, gate/up; --sibling-gemms): their GPU tests;
#                                  # Llama and BERT fp8 with and without them, --kernel-time: engine_zoo_tf_siblings
#                                  # (not yet run)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:-1}"
start=$(date +%s)
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
marker=$(mktemp)  # results written after this are the ones that go back
step() {  # step SECONDS LABEL COMMAND...: run with a limit, keep the result lines, say when it fails
  local limit=$1 label=$2
  shift 2
  echo "== $label (limit ${limit}s, at $(( $(date +%s) - start ))s)"
  local log="${OUT:-/tmp}/step_$(echo "$label" | tr -c 'A-Za-z0-9\n' '_' | cut -c1-40).log"
  timeout "$limit" "$@" 2>&1 | tee "$log" | grep "^{\|^profile\|^  top\|Error\|passed\|failed\|^| \|^summary\| | build " \
    || echo "$label: timed out or failed"
}
if [ "$part" = 1 ]; then
  step 240 "gpu tests" python3 -m pytest -q -m gpu tests/engine -p no:cacheprovider
  step 250 "engine_profile resnet50 fp16,fp8 (+ fp16:hwc I/O)" python3 benchmarks/engine_profile.py --models resnet50 \
      --engines-only --engines fp16,fp8 --engine-io fp16:hwc --name engine_profile_quant
elif [ "$part" = 2 ]; then
  step 120 "engine_mask (BERT-base, input_ids only, bf16, batch 256)" python3 benchmarks/engine_mask.py --device cuda
  step 170 "engine_profile bert bf16,fp8 (+ --gemm-gelu)" python3 benchmarks/engine_profile.py --models bert \
      --engines-only --engines bf16,fp8 --gemm-gelu --name engine_profile_quant_bert
  step 110 "engine_profile bert_ids bf16 (+ --gemm-gelu)" python3 benchmarks/engine_profile.py --models bert_ids \
      --engines-only --engines bf16 --gemm-gelu --name engine_profile_bert_ids
elif [ "$part" = 3 ]; then
  step 160 "engine_build_cache resnet50 fp16" python3 benchmarks/engine_build_cache.py --device cuda \
      --model torchvision.models:resnet50 --shape 256x3x224x224 --precision fp16
  step 100 "engine_profile resnet50 int8" python3 benchmarks/engine_profile.py --models resnet50 --engines-only \
      --engines int8 --name engine_profile_quant_int8
  step 200 "engine.py batch 1" python3 benchmarks/engine.py --batches 1 --precisions fp16,bf16 --budget-s 120 \
      --out benchmarks/results/engine_bs1
elif [ "$part" = 5 ]; then
  step 560 "engine_zoo CNNs (serving, 1; every config)" python3 benchmarks/engine_zoo.py \
      --models resnet50,convnext_tiny,efficientnet_b0 --batches serving,1 --budget-s 520 --out engine_zoo_cnn_graph
elif [ "$part" = 6 ]; then
  step 150 "gpu tests: int8/fp8 CNN engines" python3 -m pytest -q -m gpu tests/engine/test_lowp_conv_fusion.py \
      -p no:cacheprovider -p no:logging
  step 420 "engine_zoo resnet50 fp16/int8/fp8 (build phases)" python3 benchmarks/engine_zoo.py --models resnet50 \
      --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 200 --budget-s 330 \
      --out engine_zoo_resnet50_par
elif [ "$part" = 8 ]; then
  step 560 "lowp_conv (ResNet-50 shapes, tuned tiles; the fp16 Triton column)" python3 benchmarks/lowp_conv.py --iters 10
elif [ "$part" = 9 ]; then
  step 200 "gpu tests: conv passes (one-channel layout, stem padding), layer choice, 16-bit conv kernel" python3 \
      -m pytest -q -m gpu tests/engine/test_conv_fusion.py tests/engine/test_layer_choice.py \
      tests/quant/test_conv_q_gpu.py -k "one_channel or stem or layer or 16_bit" -p no:cacheprovider -p no:logging
  step 330 "engine_demo_variants (the demo's ResNet-18: stem padded, fp8 with conv margin 1.0)" python3 \
      benchmarks/engine_demo_variants.py --variants "static loaded,static no conv fusion,fp8 loaded" \
      --name engine_demo_variants_stem
elif [ "$part" = 10 ]; then
  step 560 "engine_zoo resnet50+efficientnet_b0 fp16/int8/fp8 (conv margin 1.0, stem padding)" python3 \
      benchmarks/engine_zoo.py --models resnet50,efficientnet_b0 --batches serving \
      --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 150 --budget-s 520 --out engine_zoo_cnn_margin
elif [ "$part" = 12 ] || [ "$part" = 13 ]; then  # the same runs: 12 named for the re-planning, 13 for the whole-engine timing
  out=$([ "$part" = 12 ] && echo engine_zoo_cnn_replan || echo engine_zoo_resnet50_whole)
  # 5 tests took 121 s on 2026-12-05 (two int8/fp8 CNN builds of about 40 s each)
  step 200 "gpu tests: layer choice, the conv plan, whole-engine timing" python3 -m pytest -q -m gpu \
      tests/engine/test_layer_choice.py tests/engine/test_lowp_conv_fusion.py -p no:cacheprovider -p no:logging
  # ResNet-50 alone: with both CNNs the whole-engine timing's extra compiles ran past 450 s (2026-12-05)
  step 380 "engine_zoo resnet50 fp16/int8/fp8 ($out)" python3 \
      benchmarks/engine_zoo.py --models resnet50 --batches serving \
      --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 200 --budget-s 360 --out "$out"
elif [ "$part" = 14 ]; then
  step 500 "engine_zoo efficientnet_b0 fp16/int8/fp8 with the whole-engine timing" python3 \
      benchmarks/engine_zoo.py --models efficientnet_b0 --batches serving \
      --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 200 --budget-s 480 --out engine_zoo_effnet_whole
elif [ "$part" = 15 ]; then
  step 260 "gpu tests: the int8/fp8 kernel (both forms), Linear layers on it" python3 -m pytest -q -m gpu \
      tests/quant/test_conv_q_gpu.py tests/engine/test_lowp_linear.py -p no:cacheprovider -p no:logging -n 4
  step 300 "lowp_linear (transformer GEMMs: fp16 cuBLAS, fp8/int8 cuBLAS + pass, Triton fused)" python3 \
      benchmarks/lowp_linear.py --iters 15
elif [ "$part" = 16 ]; then
  step 420 "engine_zoo vit fp16/int8/fp8 (Linear layers timed three ways)" python3 benchmarks/engine_zoo.py \
      --models vit_base_patch16_224 --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 \
      --max-build-s 200 --budget-s 390 --out engine_zoo_vit_linear
elif [ "$part" = 18 ]; then
  step 520 "engine_zoo bert fp16/int8/fp8 (Linear layers timed three ways)" python3 benchmarks/engine_zoo.py \
      --models bert --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 \
      --max-build-s 200 --budget-s 490 --out engine_zoo_bert_linear
elif [ "$part" = 17 ]; then
  step 500 "engine_zoo llama fp16/int8/fp8 (Linear layers timed three ways)" python3 benchmarks/engine_zoo.py \
      --models llama --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 \
      --max-build-s 200 --budget-s 480 --out engine_zoo_llama_linear
elif [ "$part" = 19 ]; then
  step 560 "engine_zoo vit+llama fp16/int8/fp8 with kernel groups" python3 benchmarks/engine_zoo.py \
      --models vit_base_patch16_224,llama --batches serving --configs engine_fp16,engine_fp8,engine_int8 \
      --kernel-time --max-build-s 150 --budget-s 500 --out engine_zoo_tf_kernels
elif [ "$part" = 20 ]; then
  step 560 "engine_zoo resnet50 fp16/int8/fp8 (GEMM form on 1x1 layers) with kernel groups" python3 \
      benchmarks/engine_zoo.py --models resnet50 --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 \
      --kernel-time --max-build-s 170 --budget-s 500 --out engine_zoo_resnet50_gemm
elif [ "$part" = 21 ]; then
  step 280 "gpu tests: every gpu-marked test" python3 -m pytest -q -m gpu tests -p no:cacheprovider -p no:logging -n 4
  step 300 "engine_zoo CNNs int8/fp8 at batch 1 beside the fp16 engine" python3 benchmarks/engine_zoo.py \
      --models resnet50,efficientnet_b0,convnext_tiny --batches 1 --configs engine_fp16,engine_fp8,engine_int8 \
      --max-build-s 100 --budget-s 230 --out engine_zoo_cnn_bs1_lowp
elif [ "$part" = 22 ]; then
  step 120 "gpu tests: sibling GEMMs, Linear layers" python3 -m pytest -q -m gpu tests/engine/test_lowp_siblings.py \
      tests/engine/test_lowp_linear.py -p no:cacheprovider -p no:logging -n 4
  step 440 "engine_zoo llama+bert fp8 with and without sibling int8/fp8 GEMMs, kernel groups" python3 \
      benchmarks/engine_zoo.py --models llama,bert --batches serving \
      --configs engine_fp16,engine_fp8,engine_fp8_siblings,engine_int8_siblings --kernel-time --max-build-s 120 \
      --budget-s 400 --out engine_zoo_tf_siblings
elif [ "$part" = 11 ]; then
  step 560 "engine_zoo: ConvNeXt int8/fp8 at serving batch; the CNNs' int8/fp8 at batch 1 (never run)" python3 \
      benchmarks/engine_zoo.py --models convnext_tiny,resnet50,efficientnet_b0 --batches serving,1 \
      --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 150 --budget-s 520 --out engine_zoo_cnn_lowp_all
elif [ "$part" = 7 ]; then
  step 250 "engine_profile resnet50 fp16,fp8" python3 benchmarks/engine_profile.py --models resnet50 --engines-only \
      --engines fp16,fp8 --name engine_profile_resnet50_res8
  step 300 "engine_zoo efficientnet_b0 int8/fp8" python3 benchmarks/engine_zoo.py --models efficientnet_b0 \
      --batches serving --configs compile_ro,engine_fp16,engine_fp8,engine_int8 --max-build-s 200 --budget-s 220 \
      --out engine_zoo_effnet_lowp
else
  step 170 "engine_profile bert_ids fp8 (+ --gemm-gelu)" python3 benchmarks/engine_profile.py --models bert_ids \
      --engines-only --engines fp8 --gemm-gelu --name engine_profile_bert_ids_fp8
  step 120 "conv_epilogue (cuDNN fused conv+bias+add+ReLU vs Inductor)" python3 benchmarks/conv_epilogue.py
fi
echo "total $(( $(date +%s) - start )) s"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  find benchmarks/results -type f -newer "$marker" -exec cp {} "$OUT"/ \;
fi
