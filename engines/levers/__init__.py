"""The speed levers on a rank's transformer: compiled engines and their on-disk cache, FP8 linears, quantized
attention, the step cache."""
