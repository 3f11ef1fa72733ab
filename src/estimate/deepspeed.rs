//! DeepSpeed's estimators, transcribed (see the `estimate` module docs for
//! the source).

/// `estimate_zero2_model_states_mem_needs` (stage_1_and_2.py):
/// returns `(cpu_mem, gpu_mem)` in bytes.
pub fn zero2(
    total_params: u64,
    num_gpus_per_node: u64,
    num_nodes: u64,
    cpu_offload: bool,
    additional_buffer_factor: f64,
) -> (u64, u64) {
    let n = total_params as f64;
    let total_gpus = (num_nodes * num_gpus_per_node) as f64;
    let (cpu, gpu) = if cpu_offload {
        (
            n * (4.0 * total_gpus).max(16.0) * additional_buffer_factor,
            2.0 * n,
        )
    } else {
        (
            n * 4.0 * num_gpus_per_node as f64 * additional_buffer_factor,
            2.0 * n + (18.0 * n / total_gpus).trunc(),
        )
    };
    (cpu as u64, gpu as u64)
}

/// `estimate_zero3_model_states_mem_needs` (stage3.py): returns
/// `(cpu_mem, gpu_mem, largest_layer_memory)` in bytes.
#[allow(clippy::too_many_arguments)]
pub fn zero3(
    total_params: u64,
    largest_layer_params: u64,
    num_gpus_per_node: u64,
    num_nodes: u64,
    cpu_offload: bool,
    cpu_offload_params: bool,
    zero_init: bool,
    additional_buffer_factor: f64,
) -> (u64, u64, u64) {
    let n = total_params as f64;
    let g = num_gpus_per_node as f64;
    let total_gpus = (num_nodes * num_gpus_per_node) as f64;
    let gpus_factor = 1.0 / num_nodes as f64;
    let largest_layer_memory = 4.0 * largest_layer_params as f64;
    let f = additional_buffer_factor;
    let (cpu, gpu) = if cpu_offload {
        if cpu_offload_params {
            let cpu = if zero_init {
                n * 18.0 * gpus_factor * f
            } else {
                n * (4.0 * g).max(18.0 * gpus_factor) * f
            };
            (cpu, largest_layer_memory)
        } else {
            let cpu = if zero_init {
                n * 16.0 * gpus_factor * f
            } else {
                n * (4.0 * g).max(16.0 * gpus_factor) * f
            };
            (cpu, largest_layer_memory + (2.0 * n / total_gpus).trunc())
        }
    } else {
        let cpu = if zero_init {
            largest_layer_params as f64 * 4.0 * g * f
        } else {
            n * 4.0 * g * f
        };
        (cpu, largest_layer_memory + (18.0 * n / total_gpus).trunc())
    };
    (cpu as u64, gpu as u64, largest_layer_memory as u64)
}
