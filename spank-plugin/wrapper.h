#include <slurm/spank.h>
#include <slurm/slurm_version.h>
