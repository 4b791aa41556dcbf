/*
 * A parallel region that only counts its threads, on a team of `threads`: libgomp then keeps threads - 1
 * worker threads in the calling thread's pool until that thread ends. pdserve/engine/openmp.py's SpinGovernor calls
 * it on a thread of its own to make libgomp count more threads than CPUs (its idle workers then stop
 * spinning), and ends that thread to count fewer again. Returns how many threads the team had.
 */
int pdserve_openmp_team(int threads)
{
    int started = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp atomic
        started++;
    }
    return started;
}
