#!/bin/sh
# A notify_command for dormant: when a job's environment is suspended, comment
# its key on the job's merge request, so a person (or an agent platform) can
# resume it with a new job or step in with `dormant shell KEY`.
#
#   [suspend]
#   notify_command = ["/usr/local/lib/dormant/notify-merge-request.sh"]
#
# Needs curl and jq, and a GitLab access token with the `api` scope in
# $GITLAB_TOKEN_FILE (default /etc/dormant/gitlab-token, mode 0600).
set -eu
api=${GITLAB_API_URL:-https://gitlab.example.com/api/v4}
token=$(cat "${GITLAB_TOKEN_FILE:-/etc/dormant/gitlab-token}")
doc=$(cat)                                   # dormant's JSON document
[ "$(printf '%s' "$doc" | jq -r .event)" = suspend ] || exit 0
project=$(printf '%s' "$doc" | jq -r .project_id)
job=$(printf '%s' "$doc" | jq -r .job_id)
get() { curl -fsS --max-time 3 -H "PRIVATE-TOKEN: $token" "$api/projects/$project/$1"; }
sha=$(get "jobs/$job" | jq -r .commit.id)
mr=$(get "repository/commits/$sha/merge_requests" | jq -r '.[0].iid // empty')
[ -n "$mr" ] || exit 0                       # not a merge-request pipeline
body=$(printf '%s' "$doc" | jq -r '"Job \(.job_url) suspended its environment (\(.reason)).\n\nResume it: run a job with `DORMANT_ENVIRONMENT_KEY=\(.key)`, or step in on the runner host: `dormant shell \(.key)`"')
curl -fsS --max-time 3 -H "PRIVATE-TOKEN: $token" --data-urlencode "body=$body" \
  "$api/projects/$project/merge_requests/$mr/notes" >/dev/null
