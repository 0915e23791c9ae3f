// The backend a `device` names: "cpu" (CpuBackend, fp32) or "cuda" (CudaBackend, bf16 with fp32
// masters, one GPU).  Error naming the device and the reason when it cannot be used -- a build
// without CUDA, no usable GPU -- before any work.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace moetron {

std::unique_ptr<Backend> make_backend(const std::string& device);

// "" when `device` can be used in this process, else why not (never throws).
std::string device_unavailable_reason(const std::string& device);

// Error "device: DEVICE: <the limit>" when the kernels of `device`'s backend cannot run a model of
// this head dimension and expert count (0: dense): what its Backend::check_model refuses, asked
// without the device (a plan is made on any machine, GPU or not).
void check_device_model(const std::string& device, int head_dim, int experts);

}  // namespace moetron
