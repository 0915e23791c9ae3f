#include "backend/select.h"

#include "backend/cpu.h"
#include "core/error.h"
#include "cuda/backend.h"
#include "cuda/runtime.h"

namespace moetron {

std::string device_unavailable_reason(const std::string& device) {
  if (device == "cpu") return "";
  if (device == "cuda") return gpu::cuda_unavailable_reason();
  return "'" + device + "' is not a device (cpu, cuda)";
}

void check_device_model(const std::string& device, int head_dim, int experts) {
  const std::string why = device == "cuda" ? gpu::cuda_model_limits(head_dim, experts) : "";
  if (!why.empty()) fail("device: {}: {}", device, why);
}

std::unique_ptr<Backend> make_backend(const std::string& device) {
  const std::string why = device_unavailable_reason(device);
  if (!why.empty()) fail("device: {}: {}", device, why);
  if (device == "cuda") return std::make_unique<gpu::CudaBackend>();
  return std::make_unique<CpuBackend>();
}

}  // namespace moetron
