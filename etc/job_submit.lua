--[[
mps-resilient's submission check (Slurm job_submit/lua, JobSubmitPlugins=lua in slurm.conf;
slurmctld reads job_submit.lua from the directory of slurm.conf).

A job asking for --mps-resilient without any GPU (gpu, shard or mps GRES, --gpus*) would only fail
when its first task starts: the plugin cannot see the job's GRES in sbatch/salloc. slurmctld
can, so it is refused here, at submission, with a message the user sees.

The plugin tells slurmctld through the job's SPANK environment (MPSR_MODE). Sites with a
job_submit.lua of their own call mpsr_check(job_desc) from their slurm_job_submit.
--]]

local function asks_protection(job_desc)
   local env = job_desc.spank_job_env
   if env == nil then
      return false
   end
   for _, v in pairs(env) do
      if type(v) == "string" and (v:find("^MPSR_MODE=") or v:find("^SPANK_MPSR_MODE=")) then
         return true
      end
   end
   return false
end

-- The TRES request fields hold GRES specs such as "gres:gpu:1", "gres/shard:2" or "gpu:h200:1".
local function asks_gpus(job_desc)
   for _, f in ipairs({ "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task", "gres" }) do
      local spec = job_desc[f]
      if type(spec) == "string" then
         for item in spec:gmatch("[^,]+") do
            local name = item:gsub("^gres[:/]", ""):match("^([%w_]+)")
            if name == "gpu" or name == "shard" or name == "mps" then
               return true
            end
         end
      end
   end
   return false
end

function mpsr_check(job_desc)
   if asks_protection(job_desc) and not asks_gpus(job_desc) then
      slurm.log_user("mps-resilient: --mps-resilient protects GPU work, but this job asks for no GPU: add --gres=gpu:N, --gres=shard:N, --gres=mps:N or --gpus=N (or drop --mps-resilient)")
      return slurm.ERROR
   end
   return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
   return mpsr_check(job_desc)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   return slurm.SUCCESS
end

return slurm.SUCCESS
