// host stand-in for MLX's CUDA device utils header, which every generated cuda_kernel source includes:
// the Shape / Strides parameter types of `name_shape` / `name_strides` (fixed-size arrays, as MLX passes them)
#pragma once
#include <cstdint>
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
struct Shape { int32_t data[MAX_NDIM]; int32_t operator[](int i) const { return data[i]; } };
struct Strides { int64_t data[MAX_NDIM]; int64_t operator[](int i) const { return data[i]; } };
}  // namespace mlx::core::cu
